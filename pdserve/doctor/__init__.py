"""`pdserve doctor`: reads a cluster's debug state and says where a request is stuck and why."""
