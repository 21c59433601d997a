package podmeta

import (
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// The kubelet's annotations of a static pod's mirror pod (k8s.io/kubelet's
// types): the kubelet runs a static pod under the uid of its manifest (the
// manifest's own metadata.uid, else an md5 hex of it), passes that uid to
// the runtime (K8S_POD_UID, the pod's cgroup), and shows the pod in the API
// as a mirror pod with an API-assigned uid, owned by the Node, whose
// config.mirror (and config.hash) is the static uid.
const (
	AnnotationConfigMirror = "kubernetes.io/config.mirror"
	AnnotationConfigHash   = "kubernetes.io/config.hash"
)

// StaticUID returns the uid the kubelet of node runs the mirror pod p's
// static pod under, and true, when p is such a mirror pod: bound to node,
// controlled by node's Node object (the kubelet's ownerReference; an
// apiserver with NodeRestriction lets a node create no other pods), with a
// config.mirror that could be a uid and is not p's own. Any pod's creator
// can write that annotation, so it is believed only under those conditions;
// the caller must also refuse a claim of another pod's API uid.
func StaticUID(p *corev1.Pod, node string) (string, bool) {
	claim := p.Annotations[AnnotationConfigMirror]
	if claim == "" || claim == string(p.UID) || len(claim) > 128 || strings.ContainsAny(claim, "/ \t\n\x00") {
		return "", false
	}
	if node == "" || p.Spec.NodeName != node {
		return "", false
	}
	for _, o := range p.OwnerReferences {
		if o.Controller != nil && *o.Controller {
			if o.APIVersion == "v1" && o.Kind == "Node" && o.Name == node {
				return claim, true
			}
			return "", false
		}
	}
	return "", false
}

// APIAssigned reports whether uid has the form of a uid the apiserver
// assigns (a UUID in its canonical 36-character form; clients cannot choose
// one at create). A runtime uid of another form is no API pod's: a static
// pod's, whose mirror pod carries it in config.mirror.
func APIAssigned(uid string) bool {
	if len(uid) != 36 {
		return false
	}
	for i := range len(uid) {
		c := uid[i]
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return false
			}
		default:
			if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
				return false
			}
		}
	}
	return true
}
