"""The "Model health" tab of TensorBoard: a plugin found through the ``tensorboard_plugins`` entry
point, reading this package's tags through TensorBoard's own data provider (no torch)."""
