"""What the tests share: model folders, fault injection, state machines, stores and
traces, built once here (test modules import from it, never from each other)."""
