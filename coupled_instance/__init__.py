"""The coupled role: one instance prefills and decodes its requests under a co-located policy."""
