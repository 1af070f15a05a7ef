"""The async lane (docs/async.md): the durable queue, background responses kept on it, and the drainer
that runs them at spare capacity."""
