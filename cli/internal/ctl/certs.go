package ctl

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/spf13/cobra"
)

func certsCmd(e *env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "certs",
		Short: "Development certificates for a cluster with mTLS",
	}
	cmd.AddCommand(certsInitCmd(e))
	return cmd
}

// certsInitCmd wraps internal/auth/devcerts. Its name lists default to
// devcerts' own, spelled out so that the files it wrote can be listed.
func certsInitCmd(e *env) *cobra.Command {
	o := devcerts.Options{}
	cmd := &cobra.Command{
		Use:   "init DIR",
		Short: "Make a development CA and a certificate for every role in DIR (not for production: the CA key lies beside them)",
		Long: `Make a development CA (DIR/ca.pem, DIR/ca-key.pem) and, for every principal,
DIR/<role>-<name>.pem and DIR/<role>-<name>-key.pem: an ECDSA P-256 certificate
whose URI SAN spiffe://<trust-domain>/<role>/<name> is who its holder is.
Masters, agents and gateways also get server certificates for --hosts.
An empty list (--admins "") issues none of that role.`,
		Args: exactArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			dir := args[0]
			err := devcerts.Init(dir, o)
			if errors.Is(err, devcerts.ErrCAExists) {
				return fmt.Errorf("%s already holds a CA: --force replaces it and every certificate", dir)
			}
			if err != nil {
				return err
			}
			return e.printCerts(dir, o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.TrustDomain, "trust-domain", devcerts.DefaultTrustDomain, "SPIFFE trust domain of every principal")
	f.StringSliceVar(&o.Masters, "masters", []string{"master-1"}, "master ids")
	f.StringSliceVar(&o.Agents, "agents", []string{"agent-1", "agent-2"}, "agent host ids (an agent's certificate binds its host id)")
	f.StringSliceVar(&o.Gateways, "gateways", []string{"gateway-1"}, "gateway ids")
	f.StringSliceVar(&o.Tenants, "tenants", []string{auth.DefaultTenant}, "tenants (a tenant's certificate acts for that tenant only)")
	f.StringSliceVar(&o.Admins, "admins", []string{"admin"}, "admins")
	f.StringSliceVar(&o.Hosts, "hosts", []string{"localhost", "127.0.0.1", "::1"}, "DNS names and IP addresses of the server certificates")
	f.DurationVar(&o.Validity, "validity", devcerts.DefaultValidity, "how long the certificates are valid")
	f.BoolVar(&o.Force, "force", false, "replace an existing CA and every certificate in DIR")
	return cmd
}

// certFile is one written certificate and key, as -o json prints it.
type certFile struct {
	Principal string `json:"principal,omitempty"`
	Cert      string `json:"cert"`
	Key       string `json:"key"`
}

// printCerts lists what Init wrote and how to use it.
func (e *env) printCerts(dir string, o devcerts.Options) error {
	ca := certFile{Cert: filepath.Join(dir, "ca.pem"), Key: filepath.Join(dir, "ca-key.pem")}
	var all []certFile
	var admin, tenant *certFile
	tenantName := ""
	for _, is := range []struct {
		role  auth.Role
		names []string
	}{
		{auth.RoleMaster, o.Masters}, {auth.RoleAgent, o.Agents}, {auth.RoleGateway, o.Gateways},
		{auth.RoleTenant, o.Tenants}, {auth.RoleAdmin, o.Admins},
	} {
		for _, n := range is.names {
			files := devcerts.FilesFor(dir, is.role, n)
			all = append(all, certFile{Principal: auth.Principal{TrustDomain: o.TrustDomain, Role: is.role, Name: n}.String(), Cert: files.Cert, Key: files.Key})
			switch {
			case is.role == auth.RoleAdmin && admin == nil:
				admin = &all[len(all)-1]
			case is.role == auth.RoleTenant && tenant == nil:
				tenant, tenantName = &all[len(all)-1], n
			}
		}
	}
	if e.json() {
		for _, c := range append([]certFile{ca}, all...) {
			if err := e.printJSON(c); err != nil {
				return err
			}
		}
		return nil
	}
	w := e.stdout
	fmt.Fprintf(w, "CA (trust domain %s):\n  %s\n  %s  (the CA key: development only, keep it from the cluster's hosts)\n", o.TrustDomain, ca.Cert, ca.Key)
	for _, c := range all {
		fmt.Fprintf(w, "%s:\n  %s\n  %s\n", c.Principal, c.Cert, c.Key)
	}
	// admin is the natural principal to explore with (AdminService); a
	// tenant can list the services too.
	who := admin
	if who == nil {
		who = tenant
	}
	if who != nil {
		fmt.Fprintf(w, "\nTry it against a cluster started with these files:\n")
		fmt.Fprintf(w, "  grpcurl -cacert %s -cert %s -key %s 127.0.0.1:50051 list\n", ca.Cert, who.Cert, who.Key)
	}
	if tenant != nil {
		flag := ""
		if tenantName != auth.DefaultTenant {
			flag = " --tenant " + tenantName
		}
		fmt.Fprintf(w, "  crescentctl --tls-ca %s --tls-cert %s --tls-key %s%s ls\n", ca.Cert, tenant.Cert, tenant.Key, flag)
	}
	return nil
}
