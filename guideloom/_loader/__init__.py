"""The loader's parts behind the facade: arguments, checkpoint state, figures, lifecycle and the
iterators that drive the runtime."""
