"""What a run leaves behind: the run directory and its files (:mod:`.directory`), the
checkpoint format and resuming (:mod:`.checkpoint`), reading and comparing runs
(:mod:`.results`), evaluating and exporting a checkpoint (:mod:`.inference`), library
versions (:mod:`.versions`) and flat keys for trackers (:mod:`.tracking`)."""
