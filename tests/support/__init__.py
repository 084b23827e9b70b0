"""What the tests share: waiting for a condition, factories of spans and spikes, clients of the daemons."""
