"""The notebook's widgets: the live dashboard and the launch panel; logic lives in plain modules, widgets bind to it."""
