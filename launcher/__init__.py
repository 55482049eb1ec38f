"""Tools around the Flower app that are neither engine nor app: the Linux process supervisor that
runs Flower's executables with nothing left behind (:mod:`launcher.processes`, also the test
harness's core) and the Flower backend of ``fedmf simulate`` (:mod:`launcher.flower_backend`,
registered as the ``flower`` entry point of ``fedmf.simulate_backends``). Nothing here imports
``flwr``."""
