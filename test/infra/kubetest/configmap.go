package kubetest

import (
	"os"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// ShippedConfig returns the data of the ConfigMap in the manifest at path
// (deploy/configmap.yaml: the settings the shipped admission policy reads
// as its param and the agent gets as its environment).
func ShippedConfig(t testing.TB, path string) map[string]string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var cm corev1.ConfigMap
	if err := yaml.UnmarshalStrict(b, &cm); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return cm.Data
}
