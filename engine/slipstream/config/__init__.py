"""Configuration: the config schema and recipe merging (:mod:`.schema`), the run-level
trainer options and their checks (:mod:`.options`), bundled recipes (:mod:`.recipes`)
and ``package.module:name`` import paths (:mod:`.imports`)."""
