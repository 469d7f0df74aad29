"""The `flexsarathi` command: subcommands, batch files in and resumable result files out."""
