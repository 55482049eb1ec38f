"""Tools around the Flower app that are neither engine nor app: a Linux process supervisor that
leaves nothing behind (:mod:`launcher.processes`), the launching of Flower's executables under it
(:mod:`launcher.flower_cli`: ``flwr run``, the SuperLink, the simulation; both also the test
harness's core) and the Flower backend of ``fedmf simulate`` (:mod:`launcher.flower_backend`,
registered as the ``flower`` entry point of ``fedmf.simulate_backends``). Nothing here imports
``flwr``."""
