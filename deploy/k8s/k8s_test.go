// Package k8s holds the Kubernetes manifests (kustomize) and their check:
// the kustomization renders with kustomize's own library, and every object
// it renders decodes strictly into the Kubernetes API types of its kind
// (k8s.io/api: unknown or misspelled fields and wrong types fail), with a
// few checks of what the manifests promise (issue 15).
package k8s

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

func render(t *testing.T) []runtime.Object {
	t.Helper()
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	rm, err := k.Run(filesys.MakeFsOnDisk(), ".")
	if err != nil {
		t.Fatalf("kustomize build: %v", err)
	}
	out, err := rm.AsYaml()
	if err != nil {
		t.Fatal(err)
	}
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme, policyv1.AddToScheme} {
		if err := add(scheme); err != nil {
			t.Fatal(err)
		}
	}
	dec := serializer.NewCodecFactory(scheme, serializer.EnableStrict).UniversalDeserializer()
	r := yaml.NewYAMLReader(bufioReader(out))
	var objs []runtime.Object
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		obj, gvk, err := dec.Decode(doc, nil, nil)
		if err != nil {
			t.Fatalf("rendered object does not decode strictly as its kind: %v\n%s", err, doc)
		}
		t.Logf("%s %s", gvk.Kind, obj.(interface{ GetName() string }).GetName())
		objs = append(objs, obj)
	}
	return objs
}

// TestManifests: the kustomization renders, every object is valid for its
// kind, and the deployment has what issue 15 asks of it.
func TestManifests(t *testing.T) {
	objs := render(t)
	var masters *appsv1.StatefulSet
	var agents *appsv1.DaemonSet
	var gateway *appsv1.StatefulSet
	pdbs := map[string]bool{}
	for _, o := range objs {
		switch v := o.(type) {
		case *appsv1.StatefulSet:
			switch v.Name {
			case "crescent-master":
				masters = v
			case "crescent-gateway":
				gateway = v
			}
		case *appsv1.DaemonSet:
			agents = v
		case *policyv1.PodDisruptionBudget:
			pdbs[v.Name] = true
		}
		if m, ok := o.(interface{ GetNamespace() string }); ok && m.GetNamespace() != "crescent" {
			if _, isNS := o.(*corev1.Namespace); !isNS {
				t.Errorf("%T not in namespace crescent", o)
			}
		}
	}
	if masters == nil || agents == nil || gateway == nil {
		t.Fatalf("missing: masters %v, agents %v, gateway %v", masters != nil, agents != nil, gateway != nil)
	}
	if masters.Spec.Replicas == nil || *masters.Spec.Replicas != 3 {
		t.Error("want three masters")
	}
	for _, want := range []string{"--etcd-endpoints=", "--advertise-addr="} {
		if !hasArg(masters.Spec.Template.Spec.Containers[0].Args, want) {
			t.Errorf("masters lack %s", want)
		}
	}
	if len(gateway.Spec.VolumeClaimTemplates) == 0 {
		t.Error("the gateway has no state volume")
	}
	if !agents.Spec.Template.Spec.HostNetwork {
		t.Error("agents are not on the host network (clients reach the endpoints they advertise)")
	}
	for _, ps := range []corev1.PodSpec{masters.Spec.Template.Spec, agents.Spec.Template.Spec, gateway.Spec.Template.Spec} {
		c := ps.Containers[0]
		if c.ReadinessProbe == nil || c.ReadinessProbe.HTTPGet == nil || c.ReadinessProbe.HTTPGet.Path != "/readyz" {
			t.Errorf("%s: readiness is not /readyz", c.Name)
		}
		if c.Resources.Limits.Memory().IsZero() {
			t.Errorf("%s: no memory limit", c.Name)
		}
	}
	for _, n := range []string{"crescent-master", "crescent-agent", "crescent-gateway"} {
		if !pdbs[n] {
			t.Errorf("no PodDisruptionBudget %s", n)
		}
	}
}

func hasArg(args []string, prefix string) bool {
	for _, a := range args {
		if strings.HasPrefix(a, prefix) {
			return true
		}
	}
	return false
}

func bufioReader(b []byte) *bufio.Reader { return bufio.NewReader(bytes.NewReader(b)) }
