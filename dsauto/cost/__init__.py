"""The analytic cost model: time and memory of layers, stages and whole steps under a strategy."""
