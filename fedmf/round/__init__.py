"""The privacy-critical step of a round: clip, sum, noise, step (see ARCHITECTURE.md)."""
