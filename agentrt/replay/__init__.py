"""Agent-trace replay: the trace format, a synthetic generator, a closed-loop replayer and its report."""
