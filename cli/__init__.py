"""The `met` command line: serve everything in one process, or run the api / worker roles alone."""
