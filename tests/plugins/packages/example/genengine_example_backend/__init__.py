"""A third-party backend as small as the registry allows: it echoes the prompt back (a fake, to test the registry)."""
