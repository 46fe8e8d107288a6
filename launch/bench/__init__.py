"""``launch bench``: the load (``load``), the metrics and output (``report``) and the runner (``run``)."""
