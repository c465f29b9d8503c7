package link

// Following the leader among several masters (issue 15, HA): the rules
// are internal/masterlist's (Picker), shared with the gateway's source.
// Config.MasterAddr is a comma-separated list; Run's loop talks to one
// address at a time (masterConns in link.go holds the connections).
