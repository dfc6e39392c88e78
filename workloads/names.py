"""The names the command line offers before any loader is imported.

Trace formats, workload kinds and arrival processes, kept here so `kvsim --help`
needs no numpy; the modules that implement them import these tuples.
"""

FORMATS = ("auto", "mooncake", "azure", "ragpulse", "kvsim")
KINDS = ("shared-prefix", "multi-turn", "few-shot", "agent", "parallel", "unique", "default")
ARRIVALS = ("poisson", "gamma", "constant")
