"""Operations on a running server, each a state machine the supervisor's loop turns: an expert-parallel
resize (``elastic``), a rolling restart (``reload``). They see the supervisor only through ``launch.interfaces``."""
