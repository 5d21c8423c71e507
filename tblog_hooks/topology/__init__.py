"""The model's layout over ranks, as capture reads it: which ranks hold the pieces of a sharded
tensor, and which module outputs are one rank's piece."""
