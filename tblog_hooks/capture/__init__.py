"""Select and capture: which modules are watched, the hooks on them, and the recorders that turn
a logged step's outputs, output gradients and parameter gradients into device records."""
