"""A run's folder and its process life: run folder, loggers and plot, supervisor, signals, reaper, private Ray."""
