"""Hang forensics: the ledger of collectives each rank keeps (:mod:`.record`), where ranks publish it
(:mod:`.channels`), what the ranks' ledgers say when a collective fails (:mod:`.diagnosis`), and
torch's own flight recorder (:mod:`.flight`). The torch engine's per-process use is
:mod:`dtlab.parallel.ledger`."""
