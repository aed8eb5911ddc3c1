"""The strategy search: the space of global choices, the per-stage dynamic program, top-K plans."""
