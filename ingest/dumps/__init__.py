"""Request dumps: the `--dump-dir` writer and the reader of what it wrote."""
