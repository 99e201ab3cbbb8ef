"""Reading snapshots back: discover, verify, load (plain and sharded), export."""
