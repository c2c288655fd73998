"""Store commands for people: inventory (dump) reports and tables, clearing a store, byte units."""
