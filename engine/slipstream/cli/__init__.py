"""The command line: ``slipstream train|eval|export|sweep|...`` (:mod:`.main`, whose
``main`` the ``slipstream`` script runs), the multi-process launcher (:mod:`.launch`),
building a run from a config (:mod:`.runner`) and hyper-parameter sweeps
(:mod:`.sweep`). A thin layer over the Python API."""
