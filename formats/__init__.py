"""qcore.formats: reserved for checkpoint file readers and writers. Depends on qcore only. Empty so far: the
file formats are planned."""
