"""Scale-out on Ray Serve: engine replicas behind HTTP replicas, chains routed to the replica holding them
(docs/scale-out.md). ``leases`` and ``registry`` need only the database; the modules that import Ray
(``deploy``, ``replica``, ``router``, ``remote_engine``) load only when replicas are asked for."""
