"""What producers and workers agree on: protocol, keys, settings, errors, vocabularies."""
