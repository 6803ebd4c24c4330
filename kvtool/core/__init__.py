"""The bottom layer: the KV container, files and their schemas, errors, reference attention and the
``NAME:key=value`` spec parser. Imports nothing else of kvtool."""
