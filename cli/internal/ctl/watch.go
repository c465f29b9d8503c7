package ctl

import "github.com/spf13/cobra"

func watchCmd(e *env) *cobra.Command {
	_ = e
	return &cobra.Command{Use: "watch", Short: "Print KV events from the gateway as JSON lines", Hidden: true,
		RunE: func(*cobra.Command, []string) error { return usagef("watch: not built yet") }}
}
