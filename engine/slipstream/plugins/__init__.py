"""Plugins: the base classes (:mod:`.base`, :mod:`.algorithm`, :mod:`.callback`), their
option checks (:mod:`.checks`), discovery through entry points and ordering
(:mod:`.discovery`), binding hooks for the loop (:mod:`.dispatch`), measured variants
(:mod:`.variants`) and the compatibility matrix (:mod:`.compatibility`)."""
