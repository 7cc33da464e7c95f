"""Shared helpers for chain tests: run one chain turn to completion, random token spans, a chain's kept positions."""


def run_chain_turn(engine, chain_id, prompt, params, **options):
    """Queue ``prompt`` as a turn of ``chain_id`` (``options``: add_request's, e.g. a per-request method) and step
    until it finishes; returns its final output."""
    return finish(engine, engine.add_request(prompt, params, chain_id=chain_id, **options))


def finish(engine, request_id):
    """Step until nothing is left; the final output of ``request_id``."""
    final = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == request_id and o.finished:
                final = o
    return final


def random_tokens(rng, n):
    return [rng.randrange(3, 500) for _ in range(n)]


def kept_positions(engine, chain_id):
    table = engine.chains.index.get(chain_id).table
    return [engine.cache.table_positions(table, layer).clone() for layer in range(engine.model_config.num_layers)]
