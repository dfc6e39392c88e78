"""sim: the discrete-event serving simulator, cost model, metrics and CLI."""
