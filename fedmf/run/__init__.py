"""One private run, round after round: the driver (PrivateRun), the loop both backends share, its
checkpoints, round log, outcome, release witness and the checks that watch it (see ARCHITECTURE.md)."""
