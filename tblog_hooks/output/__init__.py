"""Write: a logged step decoded into tags, encoded as one TensorBoard event, and written through
the logger's writer; event files read back."""
