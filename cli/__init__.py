"""The `pivot` command line: `pivot run`, `pivot bench ...`, and the live monitor."""
