"""The refiner: an Optuna study over the search's best plans and the knobs the cost model is least
sure of, measured with real training steps; the measurements calibrate the cost model."""
