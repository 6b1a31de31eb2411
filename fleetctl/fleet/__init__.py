"""The fleet as fleetctl knows it: the inventory, prices, probed facts, the plan and applied
state documents, the state folder, and reaching nodes over SSH and HTTP."""
