"""The notebook's widgets: dashboard and panel (a real browser: tests/browser/)."""
