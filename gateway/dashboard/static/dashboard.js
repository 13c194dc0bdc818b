// UOMP dashboard: progressive enhancement only. Without this file every action still works
// (a dangerous button posts confirmed=no and the server answers with a confirmation page).
"use strict";
document.addEventListener("submit", function (ev) {
  var form = ev.target;
  if (!(form instanceof HTMLFormElement) || !form.hasAttribute("data-confirm")) {
    return;
  }
  var flag = form.querySelector("input[name=confirmed]");
  if (window.confirm(form.getAttribute("data-confirm"))) {
    if (flag) {
      flag.value = "yes";
    }
  } else {
    ev.preventDefault();
  }
});
document.addEventListener("change", function (ev) {
  // filters apply as soon as one changes (the Filter button stays for keyboards and no-JS)
  var el = ev.target;
  if (el instanceof HTMLSelectElement && el.form && el.form.classList.contains("filters")) {
    el.form.submit();
  }
});
