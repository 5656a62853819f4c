"""The embedded CPU backend, laid out like a plugin package: ``engine`` (the backend class), ``plugin`` (its
pluggy hook, named by the ``genengine.backends`` entry point) and its private scheduler and sampling."""
