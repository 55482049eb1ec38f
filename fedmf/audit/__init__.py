"""Audits: what an auditor checks of a run, above the ledger that stores it.

* ``replay``     the read-only privacy audit of a recorded run (``fedmf audit``): reads one snapshot
                 of the ledger and recomputes ε, separations, participations and the hash chain
* ``report``     the audit's report: its rounds' columns, JSON, CSV, plot and summary lines
* ``auditor``    the audit command a finished run suggests, as the auditor's role runs it
* ``empirical``  the empirical canary audit (``fedmf audit-empirical``): a lower bound on ε from
                 the released models
"""
