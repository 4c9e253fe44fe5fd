"""The run's configuration (RunConfig, ConfigError), the DeepSpeed config built from it, the schedule."""
