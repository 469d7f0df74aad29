"""The engine: requests, the scheduler that forms passes, KV blocks, sampling; one step at a time."""
