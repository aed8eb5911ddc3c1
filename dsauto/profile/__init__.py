"""Measured costs: layer times and memory, collective bandwidths, and the profile store."""
