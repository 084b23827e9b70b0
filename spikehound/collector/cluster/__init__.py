"""Scale-out: collectors sharing one PostgreSQL, one of them the detection leader."""
