"""What several test modules share: case tables, the conformance runner, worlds to spawn."""
