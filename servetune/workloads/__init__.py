"""Request traces and workloads: trace formats, statistics, fitting and sampling."""
