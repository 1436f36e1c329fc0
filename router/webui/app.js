// The page: two views behind #/chat and #/models, one catalog shared by both.

import { Catalog } from "./catalog.js";
import { ChatView } from "./chat.js";
import { ModelsView } from "./models.js";

const catalog = new Catalog();
const chat = new ChatView(catalog);
const models = new ModelsView(catalog);

function route() {
  const view = location.hash === "#/models" ? "models" : "chat";
  document.getElementById("view-chat").hidden = view !== "chat";
  document.getElementById("view-models").hidden = view !== "models";
  for (const name of ["chat", "models"]) {
    const link = document.querySelector(`[data-testid=nav-${name}]`);
    if (name === view) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  if (view === "models") models.show();
  else models.hide();
}

function showConnection() {
  const note = document.getElementById("connection");
  note.textContent = catalog.problem ? `offline: ${catalog.problem}` : catalog.live ? "live" : "connecting…";
  note.dataset.live = String(catalog.live);
}

// Escape stops an answer (but not while the key dialog has the keyboard).
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && chat.generation && !document.getElementById("key-dialog").open) {
    event.preventDefault();
    chat.stop();
  }
});

window.addEventListener("hashchange", route);
catalog.addEventListener("change", showConnection);
route();
showConnection();
catalog.watch();
